// Launch geometry of the CUDA kernels, as plain C++ (no CUDA headers): the thread-block
// counts of every launch and the thread -> 16-block mapping of the 16x16 quantize kernel.
//
// Compiled by nvcc into the CUDA handlers and by the host compiler in tests
// (tests/cuda_launch_check.cc), so the index math is checked on machines with no GPU.
// Every count is int64_t: a tensor of 2^31 or more elements must not wrap an int.
#ifndef NVFP4_LAUNCH_H_
#define NVFP4_LAUNCH_H_

#include <cstdint>

#include "nvfp4/numerics.h"

namespace nvfp4 {

// Threads per thread block of every kernel but the 1-thread scalar ones; a multiple of the
// warp size (the 16x16 kernel's shuffles and the amax's warp reduction need full warps).
constexpr int kLaunchThreads = 256;
static_assert(kLaunchThreads % 32 == 0, "thread blocks must be whole warps");

// gridDim.x may be at most 2^31 - 1 (compute capability 3.0 and newer).
constexpr int64_t kMaxGridX = 2147483647;

// Grid-stride kernels use at most this many thread blocks: enough to fill any current GPU.
constexpr int64_t kMaxStridedGrid = 4096;

// Thread blocks of kLaunchThreads threads for `threads` threads (one per item): at least 1,
// and 0 when more than kMaxGridX would be needed, which the caller must report as an error
// (a dim3 would silently truncate it).
constexpr int64_t GridFor(int64_t threads) {
  if (threads <= 0) return 1;
  const int64_t blocks = threads / kLaunchThreads + (threads % kLaunchThreads != 0 ? 1 : 0);
  return blocks <= kMaxGridX ? blocks : 0;
}

// The grid of a grid-stride kernel over `threads` items: never more than kMaxStridedGrid.
constexpr int64_t StridedGridFor(int64_t threads) {
  if (threads <= 0) return 1;
  const int64_t blocks = threads / kLaunchThreads + (threads % kLaunchThreads != 0 ? 1 : 0);
  return blocks < kMaxStridedGrid ? blocks : kMaxStridedGrid;
}

// Threads of the 1x16 quantize kernel over a rows x cols tensor: one per 16-block.
NVFP4_HD constexpr int64_t Quantize1dThreads(int64_t rows, int64_t cols) {
  return rows * (cols / kBlock);
}

// Threads of the 16x16 quantize kernel: one warp per two 16x16 tiles side by side (the
// second one absent when a row of tiles has an odd count), lane l holding row l % 16 of
// tile l / 16. rows and cols are multiples of 16.
NVFP4_HD constexpr int64_t Quantize2dThreads(int64_t rows, int64_t cols) {
  return 32 * ((rows / kBlock) * ((cols / kBlock + 1) / 2));
}

// Where thread `thread` (global index) of the 16x16 quantize kernel works: the flat 16-block
// index row * (cols / 16) + col_block, or valid false for a lane past the tensor's edge
// (which still takes part in its half-warp's shuffles, so it must not return early).
struct Quantize2dPlace {
  bool valid;
  int64_t row;
  int64_t col_block;
  int64_t block;
};

NVFP4_HD Quantize2dPlace Quantize2dPlaceOf(int64_t thread, int64_t rows, int64_t cols) {
  const int64_t blocks_per_row = cols / kBlock;
  const int64_t pairs = (blocks_per_row + 1) / 2;
  const int64_t warp = thread / 32;
  const int lane = static_cast<int>(thread % 32);
  Quantize2dPlace p;
  // pairs == 0 only for an empty tensor, whose kernel is never launched.
  const int64_t group = pairs > 0 ? warp / pairs : 0;
  p.col_block = (pairs > 0 ? warp % pairs : 0) * 2 + lane / 16;
  p.row = group * kBlock + lane % 16;
  p.valid = pairs > 0 && group < rows / kBlock && p.col_block < blocks_per_row;
  p.block = p.row * blocks_per_row + p.col_block;
  return p;
}

}  // namespace nvfp4

#endif  // NVFP4_LAUNCH_H_
