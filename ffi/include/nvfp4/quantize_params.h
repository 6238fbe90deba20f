// The parameters of one quantize or fake quantize call, one struct for both platforms: the
// CPU kernels' job (cpu/kernel_table.h, QuantizeJob) and the CUDA kernels' arguments
// (cuda/kernels.cuh, QuantizeArgs) both extend it with their buffers. nvfp4/handlers.h
// fills it from the checked operands and the attributes, so a new static option of the
// quantize targets is a field here, an attribute in nvfp4/bindings.h and a line of
// MakeQuantizeParams (nvfp4/handlers.h), whatever the platform. Plain host/device data: no
// XLA header, so that the kernels include it.
#ifndef NVFP4_QUANTIZE_PARAMS_H_
#define NVFP4_QUANTIZE_PARAMS_H_

#include <cstdint>

#include "nvfp4/numerics.h"

namespace nvfp4 {

struct QuantizeParams {
  int64_t rows = 0;  // x viewed as (rows, cols), cols the quantized (last) axis
  int64_t cols = 0;
  bool block_2d = false;  // 16x16 blocks (1x16 otherwise)
  bool rht = false;       // the random Hadamard transform of each block first
  bool sr = false;        // stochastic rounding
  // Four Over Six (docs/NUMERICS.md section 13): kPlain, kMae or kMse; 6M of the global
  // scale (2688, or 1536 for M = 256).
  int four_over_six = kPlain;
  float six_m = k2688;
  // Fake quantize: the values times the global decode factor (or only the block scales).
  bool use_global = true;
};

}  // namespace nvfp4

#endif  // NVFP4_QUANTIZE_PARAMS_H_
