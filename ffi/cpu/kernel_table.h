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

namespace nvfp4::cpu {

struct QuantizeJob {
  const void* x = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  bool block_2d = false;
  bool rht = false;
  bool sr = false;
  GlobalScale g{};
  uint32_t k0 = 0, k1 = 0;
  uint64_t counter_offset = 0;  // SR counter of element 0 (global element offset / 8)
  // Quantize: packed codes (rows, cols/2) and scales (rows, cols/16).
  uint8_t* codes = nullptr;
  uint8_t* scales = nullptr;
  // Fake quantize: values (rows, cols); factor f32(s_b) * global, or f32(s_b).
  void* values = nullptr;
  float global = 1.0f;
  bool use_global = true;

  int64_t blocks() const { return cols / kBlock; }
  int64_t rows_per_item() const { return block_2d ? kBlock : 1; }
  // Scratch words a worker needs: the 16x16 tile maxima of a row of tiles (none for 1x16).
  int64_t scratch_words() const { return block_2d ? blocks() : 0; }
};

struct DequantizeJob {
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  float global = 0.0f;  // the decode scale D (A * RCP2688, or an imported one)
  int64_t cols = 0;
  bool rht = false;
  void* out = nullptr;
};

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
};

namespace baseline {
const KernelTable& Table();
}
namespace avx2 {
const KernelTable& Table();
}
namespace avx512 {
const KernelTable& Table();
}

// The fastest table this CPU runs, unless ForceTable chose another.
const KernelTable& BestTable();

// For tests: use the variant named `isa` ("baseline", "x86-64-v3", "x86-64-v4") from now
// on, or the best again for "" or nullptr. False if this CPU cannot run it.
bool ForceTable(const char* isa);

}  // namespace nvfp4::cpu

#endif  // NVFP4_CPU_KERNEL_TABLE_H_
