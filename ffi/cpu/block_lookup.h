// One NVFP4 block decoded in registers from a table row, and the fixed sum tree of 16 lanes:
// what the weight-only GEMV (cpu/w4a16_isa.cc) and the KV cache's decode attention
// (cpu/kv_attention_isa.cc) share. Included after cpu/simd.h by files compiled once per
// instruction set; everything is always-inline in the including file's per-ISA namespace.
#ifndef NVFP4_CPU_BLOCK_LOOKUP_H_
#define NVFP4_CPU_BLOCK_LOOKUP_H_

#include <cstdint>

#include "cpu/simd.h"

namespace nvfp4::cpu::NVFP4_ISA {
namespace {

// The lookup form of a table row (ToLookupRow, in place): the row's 16 entries are the
// values of the 16 codes (entry c the value of code c; the rounding to the table's dtype is
// symmetric, so entry 8 + c is exactly entry c negated, -0 and NaN included). AVX2 reads
// only the first 8, each as simd.h's LookupEntry; the others read the row as it is.
NVFP4_VINLINE void ToLookupRow(float* row) {
#if defined(NVFP4_SIMD_AVX2)
  for (uint32_t m = 0; m < 8; ++m) {
    uint32_t bits;
    __builtin_memcpy(&bits, row + m, 4);
    bits = LookupEntry(bits, m);
    __builtin_memcpy(row + m, &bits, 4);
  }
#else
  (void)row;
#endif
}

// The 16 values of one block: lane l is the value of code l, the 16 codes 8 bytes at p
// (element 2i in the low nibble of byte i), row a table row in its lookup form (above).
//
// AVX-512: one 16-entry permute. AVX2: each 8 lanes come from 4 code bytes broadcast to
// every lane; a right shift by 4l puts code l in the low 4 bits, and simd.h's PermuteSigned
// looks it up with its sign (one broadcast load, no byte shuffles, no mask; on Zen 3 the
// GEMV's block takes 1.73 ns against 1.90 ns with the sign masked in, and the
// two-permutes-and-a-blend lookup of all 16 entries took 1.7x the masked form).
NVFP4_VINLINE VF LookupBlock(const float* row, const uint8_t* p) {
  VF r;
#if defined(NVFP4_SIMD_AVX512)
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  b = _mm_unpacklo_epi8(b, b);
  const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(b), shifts);
  r.p[0] = (NF)_mm512_permutexvar_ps(idx, _mm512_loadu_ps(row));
#elif defined(NVFP4_SIMD_AVX2)
  const __m256 magnitudes = _mm256_loadu_ps(row);
  const __m256i right = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  for (int j = 0; j < 2; ++j) {
    int32_t word;
    __builtin_memcpy(&word, p + 4 * j, 4);
    r.p[j] = (NF)PermuteSigned(magnitudes, _mm256_srlv_epi32(_mm256_set1_epi32(word), right));
  }
#else
  for (int i = 0; i < 8; ++i) {
    r.p[(2 * i) / kLanes][(2 * i) % kLanes] = row[p[i] & 15];
    r.p[(2 * i + 1) / kLanes][(2 * i + 1) % kLanes] = row[p[i] >> 4];
  }
#endif
  return r;
}

// The fixed tree over the 16 lanes: s8[l] = a[l] + a[l + 8], s4[l] = s8[l] + s8[l + 4],
// s2[l] = s4[l] + s4[l + 2], s2[0] + s2[1] (in registers on AVX2 and AVX-512: the same adds).
NVFP4_VINLINE float SumTree16(VF acc) {
#if defined(NVFP4_SIMD_AVX512) || defined(NVFP4_SIMD_AVX2)
#if defined(NVFP4_SIMD_AVX512)
  const __m512 a = (__m512)acc.p[0];
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
#else
  const __m256 s8 = _mm256_add_ps((__m256)acc.p[0], (__m256)acc.p[1]);
#endif
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
#else
  float a[16];
  StoreV(a, acc);
  float s8[8], s4[4], s2[2];
  for (int l = 0; l < 8; ++l) s8[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  for (int l = 0; l < 2; ++l) s2[l] = s4[l] + s4[l + 2];
  return s2[0] + s2[1];
#endif
}

}  // namespace
}  // namespace nvfp4::cpu::NVFP4_ISA

#endif  // NVFP4_CPU_BLOCK_LOOKUP_H_
