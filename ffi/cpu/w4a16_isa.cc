// The weight-only (W4A16) GEMM on the CPU, compiled once per instruction set (NVFP4_ISA).
//
// docs/NUMERICS.md section 9. out (m, n) f32 = x (m, k) times the frozen NVFP4 weight held in
// its stored layout (n, k/2) codes and (n, k/16) E4M3 scales, each weight element exactly the
// value `dequantize(W, dtype)` gives it, w = dtype(f32(value(code)) * (f32(s_b) * D)), but
// decoded in registers: no copy of the weight in memory. The handler tabulates, for each of
// the 256 scale bytes, the 16 weight values of the 16 codes (16 KiB, L1-resident, in the
// variant's lookup form: ToLookupTable); a block's 16 codes are then one lookup in its scale
// byte's row (cpu/block_lookup.h).
//
// Order (the same on every ISA and thread count; the threads split the columns): the
// activations are f32 (exact from bf16, f16); element k of K goes to slot k mod 16 of the
// output element's 16 partial sums, each slot sums its terms in ascending k from +0 with one
// f32 multiply (x * w) and one f32 add per term (no FMA), and the slots are then added as a
// fixed tree: s8[l] = a[l] + a[l + 8], s4[l] = s8[l] + s8[l + 4], s2[l] = s4[l] + s4[l + 2],
// out = s2[0] + s2[1]. A NaN result is stored as the one quiet NaN (payloads are not part of
// the contract). A 16-lane VF (cpu/simd.h) is one zmm, two ymm or four xmm: the slots are its
// lanes on every ISA.
//
// As in kernels_isa.cc: nothing from the standard library, everything in the per-ISA
// namespace or always-inline.
#include <cstdint>

#include "cpu/block_lookup.h"
#include "cpu/kernel_table.h"
#include "cpu/simd.h"
#include "nvfp4/dtypes.h"
#include "nvfp4/numerics.h"

#ifndef NVFP4_ISA
#error "compile with -DNVFP4_ISA=<namespace>"
#endif

namespace nvfp4::cpu::NVFP4_ISA {
namespace {

NVFP4_VINLINE int64_t MaxI64(int64_t a, int64_t b) { return a > b ? a : b; }

#if defined(NVFP4_SIMD_AVX512)
constexpr int kMaxRows = 8;  // rows of x per pass over a column: 2 x 8 accumulators fit
#else
constexpr int kMaxRows = 4;
#endif

// The fixed tree over the 16 slots (SumTree16); NaN as the one quiet NaN.
NVFP4_VINLINE float Reduce16(VF acc) {
  const float s = SumTree16(acc);
  return s != s ? AsFloat(kNanBits) : s;
}

// Rows [row0, row0 + MR) of the output column j.
template <int MR>
NVFP4_VINLINE void Column(const W4a16Job& job, int64_t row0, int64_t j) {
  const int64_t groups = job.k / kBlock;
  const uint8_t* codes = job.codes + j * (job.k / 2);
  const uint8_t* scales = job.scales + j * groups;
  const float* x = job.x + row0 * job.k;
  VF acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = SplatF(0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    const VF w = LookupBlock(job.tables + kBlock * scales[g], codes + 8 * g);
    for (int r = 0; r < MR; ++r) {
      acc[r] = acc[r] + LoadV<VF>(x + r * job.k + kBlock * g) * w;
    }
  }
  for (int r = 0; r < MR; ++r) job.out[(row0 + r) * job.n + j] = Reduce16(acc[r]);
}

// Columns [begin, end) of the output, all rows: in blocks of rows whose f32 activations stay
// in the cache while the columns' codes stream by, each column in passes of kMaxRows rows.
void W4a16Range(const W4a16Job& job, int64_t begin, int64_t end) {
  const int64_t block_rows = kMaxRows * MaxI64(1, (int64_t{1} << 20) / (4 * job.k * kMaxRows));
  for (int64_t r0 = 0; r0 < job.m; r0 += block_rows) {
    const int64_t r1 = job.m < r0 + block_rows ? job.m : r0 + block_rows;
    for (int64_t j = begin; j < end; ++j) {
      int64_t r = r0;
      for (; r + kMaxRows <= r1; r += kMaxRows) Column<kMaxRows>(job, r, j);
      switch (r1 - r) {
#if defined(NVFP4_SIMD_AVX512)
        case 7: Column<7>(job, r, j); break;
        case 6: Column<6>(job, r, j); break;
        case 5: Column<5>(job, r, j); break;
        case 4: Column<4>(job, r, j); break;
#endif
        case 3: Column<3>(job, r, j); break;
        case 2: Column<2>(job, r, j); break;
        case 1: Column<1>(job, r, j); break;
        default: break;
      }
    }
  }
}

}  // namespace

void ToLookupTable(float* table) {
  for (int b = 0; b < 256; ++b) ToLookupRow(table + kBlock * b);
}

W4a16RangeFn W4a16Kernel(FloatType x) {
  (void)x;  // the tables hold the weights already rounded to x's dtype
  return W4a16Range;
}

}  // namespace nvfp4::cpu::NVFP4_ISA
