// The NVFP4 x NVFP4 GEMM on the CPU, compiled once per instruction set (NVFP4_ISA names it).
//
// docs/NUMERICS.md section 9. Two times an E2M1 value is an integer in [-12, 12], so the dot
// product of one 16-block of an A row with one of a B row is an exact integer d (|d| <= 2304),
// computed here with 8-bit integer multiply-adds: AVX-512 VNNI `vpdpbusd`, or `vpmaddubsw` +
// `vpmaddwd` (AVX-512BW without VNNI, AVX2), or plain integer code (the baseline). Those
// instructions multiply an unsigned byte by a signed one, so A is packed as 2 * E2M1 + 12 (in
// [0, 24]) and the offset is taken back exactly with -12 * (the block's sum of B), which
// the packing of B precomputes. The block's term
//
//     t = (f32(d) * f32(sa)) * f32(sb)
//
// is exact in f32 (d has at most 12 significant bits, each E4M3 scale 4, and no product
// leaves the f32 range), so an FMA that adds it gives the same bits as a multiply and an add.
// Each output element sums its terms in one fixed order, g = 0, 1, ..., K/16 - 1, sequentially
// from +0 in f32 (the only roundings), then out = (sum * 0.25) * alpha, where the 0.25 (the
// 2 of each 2 * E2M1) is exact. Every ISA computes each element the same way, and the
// threads split the output tiles (never K), so the result is the same bits on every ISA and
// any number of threads.
//
// Layout (kernel_table.h, GemmJob): A is unpacked to one byte per element, row by row; B to
// panels of kGemmNr = 32 columns, each 16-block g of a panel stored as 4 quads of 4
// consecutive K elements for the 32 columns ((g, quad, column, 4) bytes), so that one
// vector holds 4 K elements of 16 (AVX-512) or 8 (AVX2) columns and a broadcast of 4 A bytes
// multiplies it. A tile is kGemmMc = 64 rows of A times one B panel (32 columns x K bytes,
// from L2); the micro-kernel keeps 4 (AVX-512) or 2 (AVX2) rows x 32 columns of f32 sums in
// registers over the whole K.
//
// As in kernels_isa.cc: nothing from the standard library, everything in the per-ISA
// namespace or always-inline.
#include <cstdint>

#include "cpu/kernel_table.h"
#include "cpu/simd.h"
#include "nvfp4/numerics.h"

#ifndef NVFP4_ISA
#error "compile with -DNVFP4_ISA=<namespace>"
#endif

namespace nvfp4::cpu::NVFP4_ISA {
namespace {

// 2 * E2M1 of a 4-bit code (bit 3 the sign; -0 is 0).
constexpr int8_t kTwiceE2m1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int64_t kQuad = 4;                          // K elements per 32-bit lane
constexpr int64_t kGroupBytes = kBlock * kGemmNr;     // one 16-block of a B panel: 512 bytes

NVFP4_VINLINE int64_t MinI(int64_t a, int64_t b) { return a < b ? a : b; }

// A code byte (two codes) as its two 2 * E2M1 bytes (low nibble first, little-endian), the
// same plus 12 each (A's packing), and their sum: the packing's tables.
struct PairTable {
  uint16_t value[256];
  uint16_t offset_value[256];
  int8_t sum[256];
};

constexpr PairTable MakePairTable() {
  PairTable t{};
  for (int b = 0; b < 256; ++b) {
    const int lo = kTwiceE2m1[b & 15], hi = kTwiceE2m1[b >> 4];
    t.value[b] = static_cast<uint16_t>((lo & 0xFF) | (hi & 0xFF) << 8);
    t.offset_value[b] = static_cast<uint16_t>((lo + kGemmAOffset) | (hi + kGemmAOffset) << 8);
    t.sum[b] = static_cast<int8_t>(lo + hi);
  }
  return t;
}

constexpr PairTable kPairs = MakePairTable();

NVFP4_VINLINE int32_t Load32(const uint8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// The scaled sums of `cols` (<= 32) columns of one output row: (sum * 0.25) * alpha.
NVFP4_VINLINE void StoreRowScalar(const float* sums, float alpha, int64_t cols, float* out) {
  for (int64_t c = 0; c < cols; ++c) out[c] = (sums[c] * 0.25f) * alpha;
}

#if defined(NVFP4_SIMD_AVX512)
// ---------------------------------------------------------------------------
// AVX-512: 16 columns per zmm, two per panel; MR rows of A per micro-kernel.

// acc += u8 a . s8 b over each 4 bytes (vpdpbusd). Written as assembly so that this file,
// built for x86-64-v4 (which does not imply VNNI), can hold it; it runs only where the CPU
// has AVX512_VNNI.
NVFP4_VINLINE __m512i DotVnni(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

template <int MR, bool kVnni>
NVFP4_VINLINE void Micro(const GemmJob& job, int64_t i0, int64_t panel) {
  const int64_t groups = job.groups();
  const int8_t* bp = job.b_pack + panel * groups * kGroupBytes;
  const int32_t* cp = job.b_corr + panel * groups * kGemmNr;
  const float* sp = job.b_scale + panel * groups * kGemmNr;
  const uint8_t* a[MR];
  const float* sa[MR];
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) {
    a[r] = job.a_pack + (i0 + r) * job.k;
    sa[r] = job.a_scale + (i0 + r) * groups;
    acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  }
  const __m512i ones16 = _mm512_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* bg = bp + g * kGroupBytes;
    __m512i b[kQuad][2];
    for (int q = 0; q < kQuad; ++q) {
      b[q][0] = _mm512_loadu_si512(bg + q * 2 * 64);
      b[q][1] = _mm512_loadu_si512(bg + q * 2 * 64 + 64);
    }
    const __m512i c0 = _mm512_loadu_si512(cp + g * kGemmNr);
    const __m512i c1 = _mm512_loadu_si512(cp + g * kGemmNr + 16);
    const __m512 s0 = _mm512_loadu_ps(sp + g * kGemmNr);
    const __m512 s1 = _mm512_loadu_ps(sp + g * kGemmNr + 16);
    for (int r = 0; r < MR; ++r) {
      const uint8_t* ap = a[r] + g * kBlock;
      __m512i d0, d1;
      if constexpr (kVnni) {
        d0 = c0;
        d1 = c1;
        for (int q = 0; q < kQuad; ++q) {
          const __m512i av = _mm512_set1_epi32(Load32(ap + q * kQuad));
          d0 = DotVnni(d0, av, b[q][0]);
          d1 = DotVnni(d1, av, b[q][1]);
        }
      } else {
        // Pairs of products in 16 bits (|sum of 16| <= 16 * 24 * 12 = 4608: no overflow).
        __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
        for (int q = 0; q < kQuad; ++q) {
          const __m512i av = _mm512_set1_epi32(Load32(ap + q * kQuad));
          h0 = _mm512_add_epi16(h0, _mm512_maddubs_epi16(av, b[q][0]));
          h1 = _mm512_add_epi16(h1, _mm512_maddubs_epi16(av, b[q][1]));
        }
        d0 = _mm512_add_epi32(_mm512_madd_epi16(h0, ones16), c0);
        d1 = _mm512_add_epi32(_mm512_madd_epi16(h1, ones16), c1);
      }
      const __m512 s = _mm512_set1_ps(sa[r][g]);
      // The term (d * sa) * sb is exact: the FMA's single rounding is the add's.
      acc[r][0] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d0), s), s0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d1), s), s1, acc[r][1]);
    }
  }
  const __m512 quarter = _mm512_set1_ps(0.25f);
  const __m512 alpha = _mm512_set1_ps(job.alpha);
  const int64_t col0 = panel * kGemmNr;
  for (int r = 0; r < MR; ++r) {
    float* out = job.out + (i0 + r) * job.n + col0;
    for (int v = 0; v < 2; ++v) {
      const int64_t cols = MinI(16, job.n - col0 - 16 * v);
      if (cols <= 0) break;
      const __m512 o = _mm512_mul_ps(_mm512_mul_ps(acc[r][v], quarter), alpha);
      const __mmask16 mask = static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1u);
      _mm512_mask_storeu_ps(out + 16 * v, mask, o);
    }
  }
}

constexpr int kMr = 4;

template <bool kVnni>
void TileRows(const GemmJob& job, int64_t row_begin, int64_t row_end, int64_t panel) {
  int64_t i = row_begin;
  for (; i + kMr <= row_end; i += kMr) Micro<kMr, kVnni>(job, i, panel);
  switch (row_end - i) {
    case 3: Micro<3, kVnni>(job, i, panel); break;
    case 2: Micro<2, kVnni>(job, i, panel); break;
    case 1: Micro<1, kVnni>(job, i, panel); break;
    default: break;
  }
}

void RunTileRows(const GemmJob& job, int64_t row_begin, int64_t row_end, int64_t panel) {
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  if (vnni) {
    TileRows<true>(job, row_begin, row_end, panel);
  } else {
    TileRows<false>(job, row_begin, row_end, panel);
  }
}

// ---------------------------------------------------------------------------
// AMX-INT8 (where the CPU has it and the kernel grants the tile data; the handler decides,
// job.amx): per 16-block g, one `tdpbusd` of 16 rows of A (16 bytes of K each) by 16 columns
// of B (4 quads x 16 columns x 4 bytes: the packed panel's layout as it is) gives the 16 x 16
// exact integer dots d, the tile started from the offset correction row (loaded with stride
// 0), so d = sum (2 q_a + 12)(2 q_b) - 12 sum 2 q_b exactly as VNNI computes it. Stored to
// L1, each row's 16 sums then take the same f32 steps as above: acc = fma(f32(d) * sa, sb,
// acc), g ascending, so the bits are those of every other ISA. Two C tiles alternate between
// even and odd blocks so that the tile unit works on one while the vector unit scales the
// other.

#define NVFP4_VINLINE_LAMBDA __attribute__((always_inline))

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 the int32 sums C (16 x 16) of even and odd blocks, 2, 3 their A (16 rows x 16
// bytes), 4, 5 their B (4 quads x 64 bytes): tiles are not renamed, so alternating sets let
// one block's tile work start while the vector unit scales the previous one.
__attribute__((target("amx-tile,amx-int8"))) NVFP4_VINLINE void AmxConfigure() {
  TileConfig c;
  constexpr uint8_t kRows[6] = {16, 16, 16, 16, kQuad, kQuad};
  constexpr uint16_t kColsb[6] = {64, 64, kBlock, kBlock, 64, 64};
  for (int t = 0; t < 6; ++t) {
    c.rows[t] = kRows[t];
    c.colsb[t] = kColsb[t];
  }
  _tile_loadconfig(&c);
}

// Block g of 16 rows x 16 columns with tiles C = TC, A = TA, B = TB, its sums stored to
// d[P]; then the f32 steps of block g - 1, whose sums were stored one block earlier.
#define NVFP4_AMX_BLOCK(TC, TA, TB, P)                          \
  do {                                                          \
    _tile_zero(TC);                                             \
    _tile_loadd(TA, ap + g * kBlock, job.k);                    \
    _tile_loadd(TB, bp + g * kGroupBytes, 2 * 64);              \
    _tile_dpbusd(TC, TA, TB);                                   \
    _tile_stored(TC, d[P], 64);                                 \
    if (g > 0) ScaleBlock(d[1 - P], g - 1);                     \
  } while (0)

// Rows [i0, i0 + 16) (a_pack is padded to whole 16-row groups) times columns
// [16 * half, 16 * half + 16) of one panel; stores rows < m and columns < n. Block g's
// integer sums d (+ the offset correction) take the f32 steps of the other ISAs:
// acc = fma(f32(d) * sa, sb, acc), g ascending.
__attribute__((target("amx-tile,amx-int8"))) void AmxMicro(const GemmJob& job, int64_t i0,
                                                          int64_t panel, int half) {
  const int64_t groups = job.groups();
  const int8_t* bp = job.b_pack + panel * groups * kGroupBytes + 64 * half;
  const int32_t* cp = job.b_corr + panel * groups * kGemmNr + 16 * half;
  const float* sp = job.b_scale + panel * groups * kGemmNr + 16 * half;
  const uint8_t* ap = job.a_pack + i0 * job.k;
  const float* sa = job.a_scale + i0 * groups;
  alignas(64) int32_t d[2][256];
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  auto ScaleBlock = [&](const int32_t* sums, int64_t block) NVFP4_VINLINE_LAMBDA {
    const __m512i corr = _mm512_loadu_si512(cp + block * kGemmNr);
    const __m512 sb = _mm512_loadu_ps(sp + block * kGemmNr);
    for (int r = 0; r < 16; ++r) {
      const __m512i dv = _mm512_add_epi32(_mm512_load_si512(sums + 16 * r), corr);
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dv), _mm512_set1_ps(sa[r * groups + block]));
      acc[r] = _mm512_fmadd_ps(t, sb, acc[r]);
    }
  };
  int64_t g = 0;
  for (; g + 2 <= groups; ++g) {
    NVFP4_AMX_BLOCK(0, 2, 4, 0);
    ++g;
    NVFP4_AMX_BLOCK(1, 3, 5, 1);
  }
  if (g < groups) {
    NVFP4_AMX_BLOCK(0, 2, 4, 0);
    ScaleBlock(d[0], g);
  } else if (groups > 0) {
    ScaleBlock(d[1], groups - 1);
  }
  const __m512 quarter = _mm512_set1_ps(0.25f);
  const __m512 alpha = _mm512_set1_ps(job.alpha);
  const int64_t col0 = panel * kGemmNr + 16 * half;
  const int64_t cols = MinI(16, job.n - col0);
  if (cols <= 0) return;
  const __mmask16 mask = static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1u);
  const int64_t rows = MinI(16, job.m - i0);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 o = _mm512_mul_ps(_mm512_mul_ps(acc[r], quarter), alpha);
    _mm512_mask_storeu_ps(job.out + (i0 + r) * job.n + col0, mask, o);
  }
}
#undef NVFP4_AMX_BLOCK
#undef NVFP4_VINLINE_LAMBDA

__attribute__((target("amx-tile,amx-int8"))) void AmxTiles(const GemmJob& job, int64_t begin,
                                                          int64_t end) {
  AmxConfigure();
  const int64_t panels = job.panels();
  for (int64_t t = begin; t < end; ++t) {
    const int64_t row_begin = (t / panels) * kGemmMc;
    const int64_t row_end = MinI(job.m, row_begin + kGemmMc);
    for (int half = 0; half < 2; ++half) {
      if (t % panels * kGemmNr + 16 * half >= job.n) break;
      for (int64_t i = row_begin; i < row_end; i += 16) AmxMicro(job, i, t % panels, half);
    }
  }
  _tile_release();
}

#elif defined(NVFP4_SIMD_AVX2)
// ---------------------------------------------------------------------------
// AVX2: 8 columns per ymm, four per panel; MR rows of A per micro-kernel.

template <int MR>
NVFP4_VINLINE void Micro(const GemmJob& job, int64_t i0, int64_t panel) {
  const int64_t groups = job.groups();
  const int8_t* bp = job.b_pack + panel * groups * kGroupBytes;
  const int32_t* cp = job.b_corr + panel * groups * kGemmNr;
  const float* sp = job.b_scale + panel * groups * kGemmNr;
  const uint8_t* a[MR];
  const float* sa[MR];
  __m256 acc[MR][4];
  for (int r = 0; r < MR; ++r) {
    a[r] = job.a_pack + (i0 + r) * job.k;
    sa[r] = job.a_scale + (i0 + r) * groups;
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* bg = bp + g * kGroupBytes;
    __m256i av[MR][kQuad];
    __m256 s[MR];
    for (int r = 0; r < MR; ++r) {
      for (int q = 0; q < kQuad; ++q) {
        av[r][q] = _mm256_set1_epi32(Load32(a[r] + g * kBlock + q * kQuad));
      }
      s[r] = _mm256_set1_ps(sa[r][g]);
    }
    for (int v = 0; v < 4; ++v) {
      __m256i b[kQuad];
      for (int q = 0; q < kQuad; ++q) {
        b[q] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bg + q * 128 + v * 32));
      }
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + g * kGemmNr) + v);
      const __m256 sb = _mm256_loadu_ps(sp + g * kGemmNr + 8 * v);
      for (int r = 0; r < MR; ++r) {
        __m256i h = _mm256_maddubs_epi16(av[r][0], b[0]);
        for (int q = 1; q < kQuad; ++q) h = _mm256_add_epi16(h, _mm256_maddubs_epi16(av[r][q], b[q]));
        const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(h, ones16), c);
        acc[r][v] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d), s[r]), sb, acc[r][v]);
      }
    }
  }
  const __m256 quarter = _mm256_set1_ps(0.25f);
  const __m256 alpha = _mm256_set1_ps(job.alpha);
  const int64_t col0 = panel * kGemmNr;
  for (int r = 0; r < MR; ++r) {
    float* out = job.out + (i0 + r) * job.n + col0;
    for (int v = 0; v < 4; ++v) {
      const int64_t cols = MinI(8, job.n - col0 - 8 * v);
      if (cols <= 0) break;
      const __m256 o = _mm256_mul_ps(_mm256_mul_ps(acc[r][v], quarter), alpha);
      if (cols == 8) {
        _mm256_storeu_ps(out + 8 * v, o);
      } else {
        float tmp[8];
        _mm256_storeu_ps(tmp, o);
        for (int64_t c = 0; c < cols; ++c) out[8 * v + c] = tmp[c];
      }
    }
  }
}

constexpr int kMr = 2;

void RunTileRows(const GemmJob& job, int64_t row_begin, int64_t row_end, int64_t panel) {
  int64_t i = row_begin;
  for (; i + kMr <= row_end; i += kMr) Micro<kMr>(job, i, panel);
  if (i < row_end) Micro<1>(job, i, panel);
}

#else
// ---------------------------------------------------------------------------
// Baseline: plain integer and f32 code, the same terms in the same order.

void RunTileRows(const GemmJob& job, int64_t row_begin, int64_t row_end, int64_t panel) {
  const int64_t groups = job.groups();
  const int8_t* bp = job.b_pack + panel * groups * kGroupBytes;
  const int32_t* cp = job.b_corr + panel * groups * kGemmNr;
  const float* sp = job.b_scale + panel * groups * kGemmNr;
  const int64_t col0 = panel * kGemmNr;
  const int64_t cols = MinI(kGemmNr, job.n - col0);
  for (int64_t i = row_begin; i < row_end; ++i) {
    const uint8_t* a = job.a_pack + i * job.k;
    const float* sa = job.a_scale + i * groups;
    float acc[kGemmNr] = {};
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* bg = bp + g * kGroupBytes;
      int32_t d[kGemmNr];
      for (int64_t c = 0; c < kGemmNr; ++c) d[c] = cp[g * kGemmNr + c];
      for (int64_t q = 0; q < kQuad; ++q) {
        for (int64_t t = 0; t < kQuad; ++t) {
          const int32_t av = a[g * kBlock + q * kQuad + t];
          for (int64_t c = 0; c < kGemmNr; ++c) d[c] += av * bg[(q * kGemmNr + c) * kQuad + t];
        }
      }
      for (int64_t c = 0; c < kGemmNr; ++c) {
        const float term = (static_cast<float>(d[c]) * sa[g]) * sp[g * kGemmNr + c];
        acc[c] = acc[c] + term;
      }
    }
    StoreRowScalar(acc, job.alpha, cols, job.out + i * job.n + col0);
  }
}

#endif

}  // namespace

// Rows [begin, end) of A: bytes 2 * E2M1 + 12, and the f32 scales.
void GemmPackA(const GemmJob& job, int64_t begin, int64_t end) {
  const int64_t half = job.k / 2;
  const int64_t groups = job.groups();
  for (int64_t i = begin; i < end; ++i) {
    const uint8_t* codes = job.a_codes + i * half;
    uint8_t* out = job.a_pack + i * job.k;
    for (int64_t p = 0; p < half; ++p) {
      const uint16_t pair = kPairs.offset_value[codes[p]];
      __builtin_memcpy(out + 2 * p, &pair, sizeof(pair));
    }
    for (int64_t g = 0; g < groups; ++g) {
      job.a_scale[i * groups + g] = E4m3ToF32(job.a_scales[i * groups + g]);
    }
  }
}

// Panels [begin, end) of B: (g, quad, column, 4) bytes of 2 * E2M1, the offset corrections
// and the f32 scales; columns past n are zero (their sums are computed, never stored).
void GemmPackB(const GemmJob& job, int64_t begin, int64_t end) {
  const int64_t half = job.k / 2;
  const int64_t groups = job.groups();
  for (int64_t panel = begin; panel < end; ++panel) {
    int8_t* bp = job.b_pack + panel * groups * kGroupBytes;
    int32_t* cp = job.b_corr + panel * groups * kGemmNr;
    float* sp = job.b_scale + panel * groups * kGemmNr;
    for (int64_t c = 0; c < kGemmNr; ++c) {
      const int64_t j = panel * kGemmNr + c;
      if (j >= job.n) {
        for (int64_t g = 0; g < groups; ++g) {
          for (int64_t q = 0; q < kQuad; ++q) {
            __builtin_memset(bp + g * kGroupBytes + (q * kGemmNr + c) * kQuad, 0, kQuad);
          }
          cp[g * kGemmNr + c] = 0;
          sp[g * kGemmNr + c] = 0.0f;
        }
        continue;
      }
      const uint8_t* codes = job.b_codes + j * half;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = codes + g * (kBlock / 2);
        int32_t sum = 0;
        for (int64_t q = 0; q < kQuad; ++q) {
          const uint8_t lo = block[2 * q], hi = block[2 * q + 1];
          const uint32_t quad = uint32_t{kPairs.value[lo]} | uint32_t{kPairs.value[hi]} << 16;
          __builtin_memcpy(bp + g * kGroupBytes + (q * kGemmNr + c) * kQuad, &quad, kQuad);
          sum += kPairs.sum[lo] + kPairs.sum[hi];
        }
        cp[g * kGemmNr + c] = -kGemmAOffset * sum;
        sp[g * kGemmNr + c] = E4m3ToF32(job.b_scales[j * groups + g]);
      }
    }
  }
}

// Output tiles [begin, end), row-tile major: kGemmMc rows of A times one panel of B.
void GemmTiles(const GemmJob& job, int64_t begin, int64_t end) {
#if defined(NVFP4_SIMD_AVX512)
  if (job.amx) {
    AmxTiles(job, begin, end);
    return;
  }
#endif
  const int64_t panels = job.panels();
  for (int64_t t = begin; t < end; ++t) {
    const int64_t row_begin = (t / panels) * kGemmMc;
    RunTileRows(job, row_begin, MinI(job.m, row_begin + kGemmMc), t % panels);
  }
}

}  // namespace nvfp4::cpu::NVFP4_ISA
