// The MS-EDEN kernels of the CPU (docs/NUMERICS.md section 14): their job and the table of
// row-range functions, one table per instruction set (cpu/ms_eden_isa.cc, compiled once per
// x86 level like cpu/kernels_isa.cc); cpu/ms_eden.cc holds the handlers and picks the table
// of the level cpu/isa.cc picked.
#ifndef NVFP4_CPU_MS_EDEN_H_
#define NVFP4_CPU_MS_EDEN_H_

#include <cstdint>

#include "nvfp4/dtypes.h"
#include "nvfp4/ms_eden.h"

namespace nvfp4::cpu {

struct MsEdenJob {
  const void* x = nullptr;
  int64_t groups = 0;  // 128-element groups of x, in its flat (row-major) order
  uint32_t sign_bits[kMsEdenGroup] = {};
  MsEdenScale g{};
  uint32_t k0 = 0, k1 = 0;
  uint64_t counter_offset = 0;  // the counter of element 0 (global element offset / 8)
  // Quantize: packed codes (64 bytes a group) and scales (8 a group).
  uint8_t* codes = nullptr;
  uint8_t* scales = nullptr;
  // Fake quantize: values, value(code) * f32(s'_b) * global (global 1 without global_scale).
  void* values = nullptr;
  float global = 1.0f;
};

// Groups [begin, end); each returns the max |y| bits of the rotated values it saw (a NaN
// above inf, so the caller tells non-finite input from it).
using MsEdenRangeFn = uint32_t (*)(const MsEdenJob& job, int64_t begin, int64_t end);

struct MsEdenTable {
  MsEdenRangeFn amax[kNumFloatTypes];                               // [input]
  MsEdenRangeFn quantize[kNumFloatTypes];                           // [input]
  MsEdenRangeFn fake_quantize[kNumFloatTypes][kNumFloatTypes];  // [input][output]
};

namespace baseline {
const MsEdenTable& MsEdenKernels();
}
namespace avx2 {
const MsEdenTable& MsEdenKernels();
}
namespace avx512 {
const MsEdenTable& MsEdenKernels();
}

}  // namespace nvfp4::cpu

#endif  // NVFP4_CPU_MS_EDEN_H_
