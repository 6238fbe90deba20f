// The CPU kernels as a table of row-range functions, one table per instruction set.
//
// cpu/kernels_isa.cc is compiled once per x86 level (baseline, AVX2, AVX-512) into its own
// namespace; the handlers pick the best table the CPU supports at run time, so one wheel
// is both portable and fast. Each function processes a range of rows (or of 16-row groups
// for 16x16 blocks) and is called from the thread pool; it allocates nothing.
#ifndef NVFP4_CPU_KERNEL_TABLE_H_
#define NVFP4_CPU_KERNEL_TABLE_H_

#include <cstdint>

#include "nvfp4/dtypes.h"
#include "nvfp4/numerics.h"
#include "nvfp4/quantize_params.h"

namespace nvfp4::cpu {

// The job of quantize and fake quantize: the parameters both platforms share
// (nvfp4/quantize_params.h), the scalars read on the host, and the buffers.
struct QuantizeJob : QuantizeParams {
  const void* x = nullptr;
  GlobalScale g{};
  float amax = 0.0f;  // the tensor amax A (Four Over Six's candidate errors use it)
  uint32_t k0 = 0, k1 = 0;
  uint64_t counter_offset = 0;  // SR counter of element 0 (global element offset / 8)
  // Quantize: packed codes (rows, cols/2) and scales (rows, cols/16).
  uint8_t* codes = nullptr;
  uint8_t* scales = nullptr;
  // Fake quantize: values (rows, cols); factor f32(s_b) * global (use_global), or f32(s_b).
  void* values = nullptr;
  float global = 1.0f;

  int64_t blocks() const { return cols / kBlock; }
  int64_t rows_per_item() const { return block_2d ? kBlock : 1; }
  // Scratch words a worker needs: the 16x16 tile maxima of a row of tiles (none for 1x16);
  // under Four Over Six also both candidates' errors of its 16 rows and each tile's pick.
  int64_t scratch_words() const {
    return block_2d ? (four_over_six != kPlain ? 34 : 1) * blocks() : 0;
  }
};

struct DequantizeJob {
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  float global = 0.0f;  // the decode scale D (A * RCP2688, or an imported one)
  int64_t cols = 0;
  bool rht = false;
  void* out = nullptr;
};

// The NVFP4 x NVFP4 GEMM (cpu/gemm_isa.cc; docs/NUMERICS.md section 9) of one batch element:
// out (m, n) f32 = (0.25 * sum_g d(i, j, g) * f32(sa[i, g]) * f32(sb[j, g])) * alpha, where
// d is the exact integer dot of block g of the two rows' codes as 2 * E2M1 (in [-12, 12]),
// every term exact in f32 and the sum taken sequentially over g = 0, 1, ..., K/16 - 1 (the
// one rounding order, whatever the ISA and the thread count). The operands are first packed
// (the pack functions, parallel over rows and over panels), then the tiles are computed.
constexpr int64_t kGemmNr = 32;      // output columns per packed B panel
constexpr int64_t kGemmMc = 64;      // output rows per tile
constexpr int32_t kGemmAOffset = 12;  // A's packed values are 2 * E2M1 + 12, in [0, 24]

struct GemmJob {
  int64_t m = 0, n = 0, k = 0;  // k: elements along K (a multiple of 16)
  const uint8_t* a_codes = nullptr;   // (m, k/2)
  const uint8_t* a_scales = nullptr;  // (m, k/16) E4M3 bytes
  const uint8_t* b_codes = nullptr;   // (n, k/2)
  const uint8_t* b_scales = nullptr;  // (n, k/16)
  float alpha = 1.0f;
  float* out = nullptr;  // (m, n)
  // Packed operands (scratch owned by the handler):
  uint8_t* a_pack = nullptr;  // (m, k): 2 * E2M1 + 12 as u8
  float* a_scale = nullptr;   // (m, k/16): f32 of the E4M3 scales
  int8_t* b_pack = nullptr;   // (panels, k/16, 4, kGemmNr, 4): 2 * E2M1, zero past n
  int32_t* b_corr = nullptr;  // (panels, k/16, kGemmNr): -12 * the block's sum of b
  float* b_scale = nullptr;   // (panels, k/16, kGemmNr): f32 scales, zero past n
  // Tiles with AMX-INT8 (the x86-64-v4 variant only; the handler sets it where the CPU has
  // AMX and the kernel granted the tile data). a_pack and a_scale then have whole 16-row
  // groups (zero past m).
  bool amx = false;

  int64_t groups() const { return k / kBlock; }
  int64_t panels() const { return (n + kGemmNr - 1) / kGemmNr; }
  int64_t row_tiles() const { return (m + kGemmMc - 1) / kGemmMc; }
  int64_t tiles() const { return row_tiles() * panels(); }  // row-tile major
};

// Rows [begin, end) of A, panels [begin, end) of B, tiles [begin, end) of the output.
using GemmRangeFn = void (*)(const GemmJob& job, int64_t begin, int64_t end);

// The weight-only (W4A16) GEMM (cpu/w4a16_isa.cc; docs/NUMERICS.md section 9) of one batch
// element: out (m, n) f32 = x (m, k) times the NVFP4 weight stored (n, k) along k, each
// weight element dequantize's dtype(value(code) * factor), summed in f32 in 16 slots (k mod
// 16, ascending k) and a fixed tree over the slots. Threads split the columns.
struct W4a16Job {
  int64_t m = 0, n = 0, k = 0;
  const float* x = nullptr;         // (m, k): the activations in f32 (exact)
  const uint8_t* codes = nullptr;   // (n, k/2)
  const uint8_t* scales = nullptr;  // (n, k/16) E4M3 bytes
  const float* tables = nullptr;    // [256][16]: dtype(value(code) * f32(scale byte) * D)
  float* out = nullptr;             // (m, n)
};

// Columns [begin, end) of the output; one per dtype of x (the weight is rounded to it).
using W4a16RangeFn = void (*)(const W4a16Job& job, int64_t begin, int64_t end);

// Items [begin, end) (rows, or 16-row groups for 2D); returns the max |x| bits seen.
using QuantizeRangeFn = uint32_t (*)(const QuantizeJob& job, int64_t begin, int64_t end,
                                     uint32_t* scratch);
// Rows [begin, end) of x (rows, cols); returns the max |x| bits (post-RHT when rht).
using AmaxRangeFn = uint32_t (*)(const void* x, int64_t cols, bool rht, int64_t begin, int64_t end);
using DequantizeRangeFn = void (*)(const DequantizeJob& job, int64_t begin, int64_t end);
using RhtRangeFn = void (*)(const void* x, void* out, int64_t cols, bool inverse, int64_t begin,
                            int64_t end);

// Indexed by the FloatType (bf16, f16, f32) that checks.h parses from the buffers.
struct KernelTable {
  const char* isa;
  AmaxRangeFn amax[kNumFloatTypes];                               // [input]
  QuantizeRangeFn quantize[kNumFloatTypes];                       // [input]
  QuantizeRangeFn fake_quantize[kNumFloatTypes][kNumFloatTypes];  // [input][output]
  DequantizeRangeFn dequantize[kNumFloatTypes];                   // [output]
  RhtRangeFn rht[kNumFloatTypes];                                 // [input = output]
  GemmRangeFn gemm_pack_a;
  GemmRangeFn gemm_pack_b;
  GemmRangeFn gemm_tiles;
  // Rewrites a [256][16] table of block values (entry c of row b the value of code c under
  // scale byte b) in place into the form this variant's block lookup reads
  // (cpu/block_lookup.h): the W4A16 GEMV's and the KV cache attention's tables.
  void (*to_lookup_table)(float* table);
};

namespace baseline {
const KernelTable& Table();
W4a16RangeFn W4a16Kernel(FloatType x);
void ToLookupTable(float* table);
void GemmPackA(const GemmJob& job, int64_t begin, int64_t end);
void GemmPackB(const GemmJob& job, int64_t begin, int64_t end);
void GemmTiles(const GemmJob& job, int64_t begin, int64_t end);
}
namespace avx2 {
const KernelTable& Table();
W4a16RangeFn W4a16Kernel(FloatType x);
void ToLookupTable(float* table);
void GemmPackA(const GemmJob& job, int64_t begin, int64_t end);
void GemmPackB(const GemmJob& job, int64_t begin, int64_t end);
void GemmTiles(const GemmJob& job, int64_t begin, int64_t end);
}
namespace avx512 {
const KernelTable& Table();
W4a16RangeFn W4a16Kernel(FloatType x);
void ToLookupTable(float* table);
void GemmPackA(const GemmJob& job, int64_t begin, int64_t end);
void GemmPackB(const GemmJob& job, int64_t begin, int64_t end);
void GemmTiles(const GemmJob& job, int64_t begin, int64_t end);
}

// The fastest table this CPU runs, unless ForceTable chose another.
const KernelTable& BestTable();

// For tests: use the variant named `isa` ("baseline", "x86-64-v3", "x86-64-v4") from now
// on, or the best again for "" or nullptr. False if this CPU cannot run it.
bool ForceTable(const char* isa);

// The name of the table BestTable() returns now ("baseline", "x86-64-v3", "x86-64-v4").
const char* CurrentIsa();

}  // namespace nvfp4::cpu

#endif  // NVFP4_CPU_KERNEL_TABLE_H_
