// MS-EDEN on the CPU (docs/NUMERICS.md section 14), compiled once per instruction set
// (NVFP4_ISA names it). Every step is its nvfp4/ms_eden.h twin (shared with the CUDA
// kernels) lane by lane: the same f32 operations on the same operands, so the same bits (no
// FMA contraction: -ffp-contract=off; AddSigned's fused a + b * (+-1) rounds once, as the
// scalar a + b or a - b does). Two groups (16 blocks of 16) at a time, with 16-lane vectors
// (cpu/simd.h: one zmm, two ymm or four xmm):
//   * the rotation of each group with a block per vector: signs by xor; butterflies
//     h = 1, 2, 4, 8 inside a vector (the partner by a shuffle), h = 16, 32, 64 between
//     vectors; times R;
//   * then a 16 x 16 transpose, so that lane b holds block b and vector k its element k:
//     each block's max, scale and encode factor, the codes and each block's two sums over
//     its elements in order (one vector add per element: the sums run in element order in
//     every lane), the EDEN correction of each group, the scales' stochastic rounding;
//   * the random words of the 16 blocks as the 16 lanes of one Threefry-2x32.
//
// As in kernels_isa.cc: nothing from the standard library, everything in the per-ISA
// namespace or always-inline.
#include <cstdint>

#include "cpu/ms_eden.h"
#include "cpu/simd.h"
#include "nvfp4/dtypes.h"
#include "nvfp4/ms_eden.h"
#include "nvfp4/numerics.h"

#ifndef NVFP4_ISA
#error "compile with -DNVFP4_ISA=<namespace>"
#endif

namespace nvfp4::cpu::NVFP4_ISA {
namespace {

constexpr int kGroup = kMsEdenGroup;
constexpr int kBlocks = kMsEdenBlocks;
constexpr int kPair = 2 * kBlocks;  // the blocks of two groups: one per lane

// ---------------------------------------------------------------------------
// The rotation (Rotate128), a block per vector.

// Butterfly (simd.h): one stage of the 16-point transform.

// Butterfly stage 16 * S between the blocks j and j + S of a group (bit S of j clear).
template <int S>
NVFP4_VINLINE void CrossStage(VF g[kBlocks]) {
  for (int j = 0; j < kBlocks; ++j) {
    if ((j & S) == 0) {
      const VF a = g[j], b = g[j + S];
      g[j] = a + b;
      g[j + S] = a - b;
    }
  }
}

// One group's 128 values (f32) rotated: signs, butterflies h = 1 .. 64, times R (without
// it for kScale false).
template <bool kScale>
NVFP4_VINLINE void Rotate(const float x[kGroup], const uint32_t sign_bits[kGroup],
                          VF g[kBlocks]) {
  for (int j = 0; j < kBlocks; ++j) {
    const VI v = AsVI(LoadV<VF>(x + j * kBlock)) ^ LoadV<VI>(sign_bits + j * kBlock);
    g[j] = Butterfly<8>(Butterfly<4>(Butterfly<2>(Butterfly<1>(AsVF(v)))));
  }
  CrossStage<1>(g);
  CrossStage<2>(g);
  CrossStage<4>(g);
  if constexpr (kScale) {
    const float r = AsFloat(kRcpSqrt128Bits);
    for (int j = 0; j < kBlocks; ++j) g[j] = g[j] * r;
  }
}

// The max of a vector's 16 lanes (non-negative int32): the parts, then a shuffle tree.
NVFP4_VINLINE int32_t MaxLane(VI v) {
  NI m = v.p[0];
  for (int j = 1; j < kParts; ++j) m = m > v.p[j] ? m : v.p[j];
  for (int s = kLanes / 2; s >= 1; s /= 2) {
    const NI other = __builtin_shuffle(m, kNativeIota ^ s);
    m = m > other ? m : other;
  }
  return m[0];
}

// `groups` (1 or 2) groups from `group`, rotated into rows[16] (row b: block b), the rows
// of a missing second group zero. kAmax: without the factor R, returning the max |value|
// bits over the groups (rounding is monotonic, so the max times R is the max of the values
// times R: AmaxRange multiplies once); else with R, returning 0.
template <class T, bool kAmax>
NVFP4_VINLINE uint32_t LoadRotated(const MsEdenJob& job, int64_t group, int groups,
                                   VF rows[kPair]) {
  const auto* x = static_cast<const typename T::Storage*>(job.x) + group * kGroup;
  alignas(64) float f[kGroup];
  VI seen = SplatI(0);
  for (int h = 0; h < 2; ++h) {
    if (h < groups) {
      for (int i = 0; i < kGroup; ++i) f[i] = T::Load(x[h * kGroup + i]);
      Rotate<!kAmax>(f, job.sign_bits, rows + h * kBlocks);
    } else {
      for (int j = 0; j < kBlocks; ++j) rows[h * kBlocks + j] = SplatF(0.0f);
    }
    for (int j = 0; j < kBlocks && kAmax; ++j) {
      seen = MaxI(seen, AsVI(rows[h * kBlocks + j]) & int32_t{kAbsMask});
    }
  }
  return static_cast<uint32_t>(MaxLane(seen));
}

// ---------------------------------------------------------------------------
// The 16 x 16 transpose: row r lane c -> row c lane r, by butterflies over lane distances
// s = 8, 4, 2, 1 (rows r and r + s swap their off-diagonal s x s pieces).

template <int S>
NVFP4_VINLINE void TransposeLevel(VF rows[kPair]) {
  for (int r = 0; r < kPair; ++r) {
    if ((r & S) != 0) continue;
    VF a = rows[r], b = rows[r + S];
    if constexpr (S >= kLanes) {
      constexpr int q = S / kLanes;  // the distance in parts
      for (int j = 0; j < kParts; ++j) {
        if ((j & q) != 0) {
          const NF t = a.p[j];
          a.p[j] = b.p[j - q];
          b.p[j - q] = t;
        }
      }
    } else {
      NI take_a, take_b;  // lanes of the pair (a part, then b's) each result part takes
      for (int i = 0; i < kLanes; ++i) {
        take_a[i] = (i & S) ? kLanes + i - S : i;
        take_b[i] = (i & S) ? kLanes + i : i + S;
      }
      for (int j = 0; j < kParts; ++j) {
        const NF pa = a.p[j], pb = b.p[j];
        a.p[j] = __builtin_shuffle(pa, pb, take_a);
        b.p[j] = __builtin_shuffle(pa, pb, take_b);
      }
    }
    rows[r] = a;
    rows[r + S] = b;
  }
}

NVFP4_VINLINE void Transpose(VF rows[kPair]) {
  TransposeLevel<8>(rows);
  TransposeLevel<4>(rows);
  TransposeLevel<2>(rows);
  TransposeLevel<1>(rows);
}

// ---------------------------------------------------------------------------
// Scalar numerics of numerics.h / ms_eden.h on 16 lanes (a block per lane).

// jnp.minimum semantics (MinNan): a NaN a gives a.
NVFP4_VINLINE VF MinNanV(VF a, float b) {
  return Select((a < SplatF(b)) | (a != a), a, SplatF(b));
}

// F32ToE4m3 of v in [0, 448] or NaN.
NVFP4_VINLINE VI F32ToE4m3V(VF v) {
  const VI subnormal = AsVI(v + 16384.0f) - 0x46800000;
  const VI x = AsVI(v);
  const VI normal = Srl(x + 0x7FFFF + (Srl(x, 20) & 1), 20) - (120 << 3);
  const VI code = Select(v < SplatF(0.015625f), subnormal, normal);
  return Select(v != v, SplatI(int32_t{kE4m3Nan}), code);
}

NVFP4_VINLINE VF E4m3ToF32V(VI c) {
  const VI e = Srl(c, 3) & 0xF;
  const VI m = c & 7;
  const VF subnormal = ToF32(m) * 0.001953125f;  // m * 2^-9
  const VF normal = AsVF(((e + 120) << 23) | (m << 20));
  VF mag = Select(e == 0, subnormal, normal);
  mag = Select((c & 0x7F) == 0x7F, AsVF(SplatI(int32_t{kNanBits})), mag);
  return AsVF(AsVI(mag) | ((c & 0x80) << 24));
}

// E2m1Rn: round to nearest even, saturating at 6; the sign in bit 3. As kernels_isa.cc's:
// |y| clamped to 6 first; below 2 the f32 adder rounds |y| + 2^22 to a multiple of 0.5
// (ties to even), whose low bits are the code; from 2 up E2m1Rn's mantissa rounding. A NaN
// lane gets a code (not 0, as the scalar function's): the handler replaces every code then.
NVFP4_VINLINE VI E2m1RnV(VF y) {
  const VI bits = AsVI(y);
  const VI a = MinI(bits & int32_t{kAbsMask}, SplatI(0x40C00000));
  const VI small = AsVI(AsVF(a) + 4194304.0f) - 0x4A800000;
  const VI big = Srl(a + 0x1FFFFF + (Srl(a, 22) & 1), 22) - int32_t{kOneTop - 2u};
  return Select(a < 0x40000000, small, big) | (Srl(bits, 28) & 8);
}

// RoundScaleSr: target in [0, 448] to lo or lo + one step, hi where u * step < target - lo.
NVFP4_VINLINE VI RoundScaleSrV(VF target, VF u) {
  const VI nearest = F32ToE4m3V(target);
  const VI lo = Select(target < E4m3ToF32V(nearest), nearest - 1, nearest);
  const VF lo_value = E4m3ToF32V(lo);
  const VF step = E4m3ToF32V(lo + 1) - lo_value;
  return Select(u * step < target - lo_value, lo + 1, lo);
}

// The uniforms of the 16 blocks from flat block `first`: block b hashes the counter
// counter_offset + 2b (64-bit) and takes the top 24 bits of the first word (Threefry2x32).
NVFP4_VINLINE VF Uniforms16(const MsEdenJob& job, int64_t first) {
  const uint64_t base = job.counter_offset + 2u * static_cast<uint64_t>(first);
  const VI offset = Iota() + Iota();
  const VI lo = SplatI(static_cast<int32_t>(static_cast<uint32_t>(base))) + offset;
  const VI carry = LtU(lo, offset);  // -1 where the low word wrapped
  VI x0 = SplatI(static_cast<int32_t>(static_cast<uint32_t>(base >> 32))) - carry;
  VI x1 = lo;
  // The full schedule; the compiler drops the last key word of x1, which nothing reads.
  Threefry2x32Schedule(
      job.k0, job.k1, x0, x1, [](VI x, uint32_t k) { return x + static_cast<int32_t>(k); },
      [](VI x, int r) { return RotL(x, r); });
  return ToF32(Srl(x0, 8)) * 5.9604644775390625e-8f;  // (w0 >> 8) * 2^-24, exact
}

// ---------------------------------------------------------------------------
// MsEdenEncodeGroup of two groups, a block per lane.

struct Encoded {
  VI codes[kBlock];  // codes[k] lane b: block b's element k
  VI scales;         // lane b: block b's chosen E4M3 byte
  VI block_max;      // lane b: block b's max |value| bits
};

// cols[k] lane b: block b's element k (rotated), for the 16 blocks from flat block `first`.
NVFP4_VINLINE Encoded EncodePair(const MsEdenJob& job, const VF cols[kBlock], int64_t first) {
  const MsEdenScale& g = job.g;
  VI m = SplatI(0);
  for (int k = 0; k < kBlock; ++k) m = MaxI(m, AsVI(cols[k]) & int32_t{kAbsMask});
  VI s = F32ToE4m3V(MinNanV(AsVF(m) * g.enc_rcpv, kE4m3Max));
  s = Select(s == 0, SplatI(int32_t{kE4m3One}), s);
  const VF scale_value = E4m3ToF32V(s);
  const VF enc = MinNanV(SplatF(1.0f) / (scale_value * g.dec), kFltMax);
  Encoded out;
  out.block_max = m;
  VF n = SplatF(0.0f), d = SplatF(0.0f);
  for (int k = 0; k < kBlock; ++k) {
    const VF v = cols[k] * enc;
    out.codes[k] = E2m1RnV(v);
    n = n + v * v;
    d = d + v * E2m1Value(out.codes[k]);
  }
  // Each group's sums over its 8 blocks in order from +0, and its correction.
  alignas(64) float ns[kPair], ds[kPair];
  StoreV(ns, n);
  StoreV(ds, d);
  float correction[2];
  for (int h = 0; h < 2; ++h) {
    float num = 0.0f, den = 0.0f;
    for (int b = h * kBlocks; b < (h + 1) * kBlocks; ++b) {
      num = num + ns[b];
      den = den + ds[b];
    }
    correction[h] = den == 0.0f ? 1.0f : num / den;
  }
  const VF corr = Select(Iota() < kBlocks, SplatF(correction[0]), SplatF(correction[1]));
  out.scales = RoundScaleSrV(MinNanV(scale_value * corr, kE4m3Max), Uniforms16(job, first));
  return out;
}

// ---------------------------------------------------------------------------
// The row-range functions.

template <class T>
uint32_t AmaxRange(const MsEdenJob& job, int64_t begin, int64_t end) {
  uint32_t seen = 0;
  VF rows[kPair];
  for (int64_t group = begin; group < end; group += 2) {
    const int groups = end - group >= 2 ? 2 : 1;
    const uint32_t m = LoadRotated<T, true>(job, group, groups, rows);
    seen = m > seen ? m : seen;
  }
  // R times the max (|values| bits are ordered as the values; NaN stays NaN).
  return AsBits(AsFloat(seen) * AsFloat(kRcpSqrt128Bits)) & kAbsMask;
}

// Packed codes and scale bytes of `groups` groups from `group`.
NVFP4_VINLINE void PutCodes(const MsEdenJob& job, int64_t group, int groups, const Encoded& e) {
  // Byte i of block b is codes[2i] | codes[2i + 1] << 4, lane b; four bytes to a word.
  VI words[2];
  for (int w = 0; w < 2; ++w) {
    VI word = SplatI(0);
    for (int i = 0; i < 4; ++i) {
      const int k = 2 * (4 * w + i);
      word = word | ((e.codes[k] | (e.codes[k + 1] << 4)) << (8 * i));
    }
    words[w] = word;
  }
  alignas(64) uint32_t lo[kPair], hi[kPair];
  StoreV(lo, words[0]);
  StoreV(hi, words[1]);
  alignas(64) uint8_t scales[kPair];
  NarrowStoreU8(scales, e.scales);
  const int blocks = groups * kBlocks;
  uint8_t* codes = job.codes + group * (kGroup / 2);
  for (int b = 0; b < blocks; ++b) {
    __builtin_memcpy(codes + 8 * b, lo + b, 4);
    __builtin_memcpy(codes + 8 * b + 4, hi + b, 4);
    job.scales[group * kBlocks + b] = scales[b];
  }
}

// The values of `groups` groups: value(code) * (f32(scale) * global), back in rows.
template <class U>
NVFP4_VINLINE void PutValues(const MsEdenJob& job, int64_t group, int groups, const Encoded& e) {
  const VF factor = E4m3ToF32V(e.scales) * job.global;
  VF rows[kPair];
  for (int k = 0; k < kBlock; ++k) rows[k] = E2m1Value(e.codes[k]) * factor;
  Transpose(rows);  // rows[b]: block b's 16 values
  auto* out = static_cast<typename U::Storage*>(job.values) + group * kGroup;
  alignas(64) float v[kBlock];
  for (int b = 0; b < groups * kBlocks; ++b) {
    StoreV(v, rows[b]);
    for (int i = 0; i < kBlock; ++i) out[b * kBlock + i] = U::Store(v[i]);
  }
}

template <class T, class U, bool kValues>
uint32_t EncodeRange(const MsEdenJob& job, int64_t begin, int64_t end) {
  uint32_t seen = 0;
  VF rows[kPair];
  for (int64_t group = begin; group < end; group += 2) {
    const int groups = end - group >= 2 ? 2 : 1;
    LoadRotated<T, false>(job, group, groups, rows);
    Transpose(rows);  // rows[k] lane b: block b's element k
    const Encoded e = EncodePair(job, rows, group * kBlocks);
    const uint32_t m = static_cast<uint32_t>(MaxLane(e.block_max));
    seen = m > seen ? m : seen;
    if constexpr (kValues) {
      PutValues<U>(job, group, groups, e);
    } else {
      PutCodes(job, group, groups, e);
    }
  }
  return seen;
}

template <class T>
uint32_t QuantizeRange(const MsEdenJob& job, int64_t begin, int64_t end) {
  return EncodeRange<T, F32, false>(job, begin, end);
}

template <class T>
constexpr MsEdenRangeFn kFake[kNumFloatTypes] = {
    EncodeRange<T, Bf16, true>, EncodeRange<T, F16, true>, EncodeRange<T, F32, true>};

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
