// The 16-lane vectors of the CPU kernels: one 16-element block per vector.
//
// Included only by cpu/kernels_isa.cc, which is compiled once per instruction set. A VF
// (16 x f32) or VI (16 x i32) is kParts native vectors of kLanes lanes: one zmm register
// with AVX-512, two ymm with AVX2, four xmm with SSE2 (the portable baseline). Their
// operators work part by part on GCC's vector extensions, which GCC compiles well at the
// native width (a 16-lane vector on AVX2 it would split badly: its selects turn scalar).
// The few operations GCC lowers badly at any width (widening loads, narrowing stores,
// nibble packing, the E2M1 table lookup) use intrinsics for AVX-512 and AVX2, and plain
// lane loops elsewhere.
//
// Everything is always-inline and in the per-ISA namespace of the including file, so no
// out-of-line copy compiled for one instruction set can be shared with another.
#ifndef NVFP4_CPU_SIMD_H_
#define NVFP4_CPU_SIMD_H_

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define NVFP4_SIMD_AVX512 1
#elif defined(__AVX2__)
#define NVFP4_SIMD_AVX2 1
#endif

#if defined(NVFP4_SIMD_AVX512) || defined(NVFP4_SIMD_AVX2)
// GCC 12 flags the deliberately undefined pass-through operand of some AVX-512 intrinsics
// (`__m512i __Y = __Y;` in its headers) once they are inlined.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

#define NVFP4_VINLINE inline __attribute__((always_inline))

namespace nvfp4::cpu::NVFP4_ISA {
namespace {

#if defined(NVFP4_SIMD_AVX512)
constexpr int kLanes = 16;
#elif defined(NVFP4_SIMD_AVX2)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
constexpr int kParts = 16 / kLanes;

// Native vectors.
typedef float NF __attribute__((vector_size(4 * kLanes)));
typedef int32_t NI __attribute__((vector_size(4 * kLanes)));
typedef uint32_t NU __attribute__((vector_size(4 * kLanes)));
// 16-bit lanes, for the amax of bf16 and f16 (two of these per 16-lane part).
typedef uint16_t NW __attribute__((vector_size(4 * kLanes)));

#if defined(NVFP4_SIMD_AVX512)
constexpr NI kNativeIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#elif defined(NVFP4_SIMD_AVX2)
constexpr NI kNativeIota = {0, 1, 2, 3, 4, 5, 6, 7};
#else
constexpr NI kNativeIota = {0, 1, 2, 3};
#endif

struct VI {
  NI p[kParts];
};
struct VF {
  NF p[kParts];
};

NVFP4_VINLINE VI SplatI(int32_t s) {
  VI r;
  for (int j = 0; j < kParts; ++j) r.p[j] = NI{} + s;
  return r;
}
NVFP4_VINLINE VF SplatF(float s) {
  VF r;
  for (int j = 0; j < kParts; ++j) r.p[j] = s - NF{};  // s - 0 is s, -0 included
  return r;
}

// Lane i (0..15).
NVFP4_VINLINE int32_t Lane(const VI& v, int i) { return v.p[i / kLanes][i % kLanes]; }

// 0, 1, ..., 15.
NVFP4_VINLINE VI Iota() {
  VI r;
  for (int j = 0; j < kParts; ++j) {
    for (int i = 0; i < kLanes; ++i) r.p[j][i] = j * kLanes + i;
  }
  return r;
}

// Bit casts.
NVFP4_VINLINE VI AsVI(VF v) {
  VI r;
  for (int j = 0; j < kParts; ++j) r.p[j] = (NI)v.p[j];
  return r;
}
NVFP4_VINLINE VF AsVF(VI v) {
  VF r;
  for (int j = 0; j < kParts; ++j) r.p[j] = (NF)v.p[j];
  return r;
}

// int32 -> f32 conversion (exact for the small integers the kernels convert).
NVFP4_VINLINE VF ToF32(VI v) {
  VF r;
  for (int j = 0; j < kParts; ++j) r.p[j] = __builtin_convertvector(v.p[j], NF);
  return r;
}

#define NVFP4_BINARY(V, S, op)                                     \
  NVFP4_VINLINE V operator op(V a, V b) {                          \
    V r;                                                           \
    for (int j = 0; j < kParts; ++j) r.p[j] = a.p[j] op b.p[j];    \
    return r;                                                      \
  }                                                                \
  NVFP4_VINLINE V operator op(V a, S b) { return a op Splat##V(b); } \
  NVFP4_VINLINE V operator op(S a, V b) { return Splat##V(a) op b; }
#define SplatVI SplatI
#define SplatVF SplatF
NVFP4_BINARY(VI, int32_t, &)
NVFP4_BINARY(VI, int32_t, |)
NVFP4_BINARY(VI, int32_t, ^)
NVFP4_BINARY(VF, float, +)
NVFP4_BINARY(VF, float, -)
NVFP4_BINARY(VF, float, *)
NVFP4_BINARY(VF, float, /)
#undef NVFP4_BINARY

// Integer + and - wrap around (computed as uint32: no signed overflow).
NVFP4_VINLINE VI operator+(VI a, VI b) {
  for (int j = 0; j < kParts; ++j) a.p[j] = (NI)((NU)a.p[j] + (NU)b.p[j]);
  return a;
}
NVFP4_VINLINE VI operator-(VI a, VI b) {
  for (int j = 0; j < kParts; ++j) a.p[j] = (NI)((NU)a.p[j] - (NU)b.p[j]);
  return a;
}
NVFP4_VINLINE VI operator+(VI a, int32_t b) { return a + SplatI(b); }
NVFP4_VINLINE VI operator+(int32_t a, VI b) { return SplatI(a) + b; }
NVFP4_VINLINE VI operator-(VI a, int32_t b) { return a - SplatI(b); }
NVFP4_VINLINE VI operator-(int32_t a, VI b) { return SplatI(a) - b; }

// Comparisons give masks: -1 where true, 0 where false (signed for VI).
#define NVFP4_COMPARE(V, S, op)                                              \
  NVFP4_VINLINE VI operator op(V a, V b) {                                   \
    VI r;                                                                    \
    for (int j = 0; j < kParts; ++j) r.p[j] = (NI)(a.p[j] op b.p[j]);        \
    return r;                                                                \
  }                                                                          \
  NVFP4_VINLINE VI operator op(V a, S b) { return a op Splat##V(b); }
NVFP4_COMPARE(VI, int32_t, ==)
NVFP4_COMPARE(VI, int32_t, !=)
NVFP4_COMPARE(VI, int32_t, <)
NVFP4_COMPARE(VI, int32_t, <=)
NVFP4_COMPARE(VI, int32_t, >)
NVFP4_COMPARE(VI, int32_t, >=)
NVFP4_COMPARE(VF, float, <)
NVFP4_COMPARE(VF, float, !=)
#undef NVFP4_COMPARE
#undef SplatVI
#undef SplatVF

NVFP4_VINLINE VI operator-(VI a) { return SplatI(0) - a; }
NVFP4_VINLINE VI operator<<(VI a, int n) {
  for (int j = 0; j < kParts; ++j) a.p[j] = (NI)((NU)a.p[j] << n);
  return a;
}
// Logical (unsigned) shift right.
NVFP4_VINLINE VI Srl(VI a, int n) {
  for (int j = 0; j < kParts; ++j) a.p[j] = (NI)((NU)a.p[j] >> n);
  return a;
}
// Rotate left (as uint32).
NVFP4_VINLINE VI RotL(VI a, int n) { return (a << n) | Srl(a, 32 - n); }
// Unsigned a < b, as a mask.
NVFP4_VINLINE VI LtU(VI a, VI b) {
  VI r;
  for (int j = 0; j < kParts; ++j) r.p[j] = (NI)((NU)a.p[j] < (NU)b.p[j]);
  return r;
}

// m ? a : b lane by lane, m a mask (-1 or 0 in each lane).
NVFP4_VINLINE VI Select(VI m, VI a, VI b) {
  VI r;
  for (int j = 0; j < kParts; ++j) r.p[j] = m.p[j] ? a.p[j] : b.p[j];
  return r;
}
NVFP4_VINLINE VF Select(VI m, VF a, VF b) {
  VF r;
  for (int j = 0; j < kParts; ++j) r.p[j] = m.p[j] ? a.p[j] : b.p[j];
  return r;
}
// Signed max and min: one vpmaxsd / vpminsd per part on AVX2 and AVX-512 (GCC 12 turns only
// some of the selects into them; the rest stay a compare and a byte blend, two ops).
NVFP4_VINLINE VI MaxI(VI a, VI b) {
#if defined(NVFP4_SIMD_AVX512)
  a.p[0] = (NI)_mm512_max_epi32((__m512i)a.p[0], (__m512i)b.p[0]);
  return a;
#elif defined(NVFP4_SIMD_AVX2)
  for (int j = 0; j < kParts; ++j) a.p[j] = (NI)_mm256_max_epi32((__m256i)a.p[j], (__m256i)b.p[j]);
  return a;
#else
  return Select(a > b, a, b);
#endif
}
NVFP4_VINLINE VI MinI(VI a, VI b) {
#if defined(NVFP4_SIMD_AVX512)
  a.p[0] = (NI)_mm512_min_epi32((__m512i)a.p[0], (__m512i)b.p[0]);
  return a;
#elif defined(NVFP4_SIMD_AVX2)
  for (int j = 0; j < kParts; ++j) a.p[j] = (NI)_mm256_min_epi32((__m256i)a.p[j], (__m256i)b.p[j]);
  return a;
#else
  return Select(a < b, a, b);
#endif
}
// a < b ? a : b lane by lane (b where either is NaN): x86's minps is exactly this select.
NVFP4_VINLINE VF MinF(VF a, VF b) {
#if defined(NVFP4_SIMD_AVX512)
  a.p[0] = (NF)_mm512_min_ps((__m512)a.p[0], (__m512)b.p[0]);
  return a;
#elif defined(NVFP4_SIMD_AVX2)
  for (int j = 0; j < kParts; ++j) a.p[j] = (NF)_mm256_min_ps((__m256)a.p[j], (__m256)b.p[j]);
  return a;
#else
  return Select(a < b, a, b);
#endif
}

// a + b * s for s = +1 or -1 in each lane: the product is exact, so this is the one rounding
// of a + b or a - b, bit for bit (NaN payloads aside), in one instruction where the ISA
// has a fused multiply-add and as an exact sign flip and an add elsewhere.
NVFP4_VINLINE VF AddSigned(VF a, VF b, VF s) {
  VF r;
#if defined(__FMA__) && (defined(NVFP4_SIMD_AVX512) || defined(NVFP4_SIMD_AVX2))
  for (int j = 0; j < kParts; ++j) {
#if defined(NVFP4_SIMD_AVX512)
    r.p[j] = (NF)_mm512_fmadd_ps((__m512)b.p[j], (__m512)s.p[j], (__m512)a.p[j]);
#else
    r.p[j] = (NF)_mm256_fmadd_ps((__m256)b.p[j], (__m256)s.p[j], (__m256)a.p[j]);
#endif
  }
#else
  const NI sign = NI{} + INT32_MIN;
  for (int j = 0; j < kParts; ++j) r.p[j] = a.p[j] + (NF)((NI)b.p[j] ^ ((NI)s.p[j] & sign));
#endif
  return r;
}

// Butterfly stage H < 16 of a 16-point Hadamard inside one block's vector (the RHT's Rht16
// and MS-EDEN's rotation): lane i gets v[i] + v[i ^ H] (bit H of i clear) or v[i ^ H] - v[i]
// (set): the partner plus v times +-1, the scalar butterflies' additions, the same bits.
template <int H>
NVFP4_VINLINE VF Butterfly(VF v) {
  const VF sign = Select((Iota() & H) != 0, SplatF(-1.0f), SplatF(1.0f));
  VF partner;
  for (int j = 0; j < kParts; ++j) {
    if constexpr (H >= kLanes) {
      partner.p[j] = v.p[j ^ (H / kLanes)];
    } else {
      partner.p[j] = __builtin_shuffle(v.p[j], kNativeIota ^ H);
    }
  }
  return AddSigned(partner, v, sign);
}

// Loads and stores of a native vector, or of a VF / VI part by part: one unaligned native
// load or store per part. (A whole-struct memcpy of a two-ymm VF, GCC 12 at -march=x86-64-v3,
// goes through the stack in 16-byte pieces, and the 32-byte reloads then miss store
// forwarding: the AVX2 weight-only GEMV ran 3x slower than the SSE2 one.)
template <class V>
NVFP4_VINLINE V LoadV(const void* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
template <>
NVFP4_VINLINE VF LoadV<VF>(const void* p) {
  VF v;
  for (int j = 0; j < kParts; ++j) v.p[j] = LoadV<NF>(static_cast<const NF*>(p) + j);
  return v;
}
template <>
NVFP4_VINLINE VI LoadV<VI>(const void* p) {
  VI v;
  for (int j = 0; j < kParts; ++j) v.p[j] = LoadV<NI>(static_cast<const NI*>(p) + j);
  return v;
}

template <class V>
NVFP4_VINLINE void StoreV(void* p, V v) {
  __builtin_memcpy(p, &v, sizeof(v));
}
template <>
NVFP4_VINLINE void StoreV<VF>(void* p, VF v) {
  for (int j = 0; j < kParts; ++j) StoreV<NF>(static_cast<NF*>(p) + j, v.p[j]);
}
template <>
NVFP4_VINLINE void StoreV<VI>(void* p, VI v) {
  for (int j = 0; j < kParts; ++j) StoreV<NI>(static_cast<NI*>(p) + j, v.p[j]);
}

// ---------------------------------------------------------------------------
// Widening loads, narrowing stores.

// 16 u16 at p, zero-extended.
NVFP4_VINLINE VI WidenU16(const void* p) {
  VI r;
#if defined(NVFP4_SIMD_AVX512)
  r.p[0] = (NI)_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
#elif defined(NVFP4_SIMD_AVX2)
  const auto* q = static_cast<const __m128i*>(p);
  r.p[0] = (NI)_mm256_cvtepu16_epi32(_mm_loadu_si128(q));
  r.p[1] = (NI)_mm256_cvtepu16_epi32(_mm_loadu_si128(q + 1));
#else
  uint16_t h[16];
  __builtin_memcpy(h, p, sizeof(h));
  for (int i = 0; i < 16; ++i) r.p[i / kLanes][i % kLanes] = h[i];
#endif
  return r;
}

// 16 u8 at p, zero-extended.
NVFP4_VINLINE VI WidenU8(const void* p) {
  VI r;
#if defined(NVFP4_SIMD_AVX512)
  r.p[0] = (NI)_mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
#elif defined(NVFP4_SIMD_AVX2)
  const auto* q = static_cast<const uint8_t*>(p);
  r.p[0] = (NI)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  r.p[1] = (NI)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
#else
  uint8_t b[16];
  __builtin_memcpy(b, p, sizeof(b));
  for (int i = 0; i < 16; ++i) r.p[i / kLanes][i % kLanes] = b[i];
#endif
  return r;
}

// Stores each lane (every lane in [0, 0xFFFF]) as 16 u16.
NVFP4_VINLINE void NarrowStoreU16(void* p, VI v) {
#if defined(NVFP4_SIMD_AVX512)
  _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)v.p[0]));
#elif defined(NVFP4_SIMD_AVX2)
  const __m256i packed = _mm256_packus_epi32((__m256i)v.p[0], (__m256i)v.p[1]);
  _mm256_storeu_si256(static_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
#else
  uint16_t h[16];
  for (int i = 0; i < 16; ++i) h[i] = static_cast<uint16_t>(Lane(v, i));
  __builtin_memcpy(p, h, sizeof(h));
#endif
}

// Stores each lane (every lane in [0, 0xFF]) as 16 u8.
NVFP4_VINLINE void NarrowStoreU8(void* p, VI v) {
#if defined(NVFP4_SIMD_AVX512)
  _mm_storeu_si128(static_cast<__m128i*>(p), _mm512_cvtepi32_epi8((__m512i)v.p[0]));
#elif defined(NVFP4_SIMD_AVX2)
  const __m256i words =
      _mm256_permute4x64_epi64(_mm256_packus_epi32((__m256i)v.p[0], (__m256i)v.p[1]), 0xD8);
  const __m128i bytes =
      _mm_packus_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  _mm_storeu_si128(static_cast<__m128i*>(p), bytes);
#else
  uint8_t b[16];
  for (int i = 0; i < 16; ++i) b[i] = static_cast<uint8_t>(Lane(v, i));
  __builtin_memcpy(p, b, sizeof(b));
#endif
}

// ---------------------------------------------------------------------------
// E2M1 code values.

// The signed 8-entry lookup of AVX2 (vpermps reads 8 lanes): a table of the 8 magnitudes in
// their lookup form, entry m's bits xor (m << 28) (LookupEntry), is permuted by the index's
// low 3 bits, then xor-ed with the index shifted left by 28: its 4 low bits land at 28-31
// (every higher bit shifted out), bits 28-30 cancel m and bit 31 is the code's sign bit 3.
// Entry 8 + m, the negated entry m, is never stored. One vector op fewer per 8 lanes than a
// masked sign, with an immediate shift (on Zen 3 vpermps shares its pipes with the shifts and
// multiplies). The E2M1 values here and the table rows of cpu/block_lookup.h use it.
constexpr uint32_t LookupEntry(uint32_t bits, uint32_t m) { return bits ^ (m << 28); }

#if defined(NVFP4_SIMD_AVX2)
NVFP4_VINLINE __m256 PermuteSigned(__m256 table, __m256i idx) {
  return _mm256_xor_ps(_mm256_permutevar8x32_ps(table, idx),
                       _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
#endif

// The signed E2M1 value of each lane's low 4 bits (bit 3 the sign: 0x8 is -0).
NVFP4_VINLINE VF E2m1Value(VI code) {
#if defined(NVFP4_SIMD_AVX512)
  const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f,
                                      -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  VF r;
  r.p[0] = (NF)_mm512_permutexvar_ps((__m512i)code.p[0], table);
  return r;
#elif defined(NVFP4_SIMD_AVX2)
  const __m256 table = _mm256_castsi256_ps(_mm256_setr_epi32(
      LookupEntry(0x00000000, 0), LookupEntry(0x3F000000, 1), LookupEntry(0x3F800000, 2),
      LookupEntry(0x3FC00000, 3), LookupEntry(0x40000000, 4), LookupEntry(0x40400000, 5),
      LookupEntry(0x40800000, 6), LookupEntry(0x40C00000, 7)));
  VF r;
  for (int j = 0; j < 2; ++j) r.p[j] = (NF)PermuteSigned(table, (__m256i)code.p[j]);
  return r;
#else
  const VI m = code & 7;
  const VI normal = ((Srl(m, 1) + 126) << 23) | ((m & 1) << 22);
  VI bits = Select(m == 1, SplatI(0x3F000000), SplatI(0));
  bits = Select(m >= 2, normal, bits);
  return AsVF(bits | ((code & 8) << 28));
#endif
}

}  // namespace
}  // namespace nvfp4::cpu::NVFP4_ISA

#endif  // NVFP4_CPU_SIMD_H_
