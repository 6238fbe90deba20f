// Host-side check of the CUDA kernels' launch geometry (ffi/include/nvfp4/launch.h), built
// and run by tests/core/test_cuda_launch.py with the host C++ compiler: no GPU needed.
//
// Prints one line per failed check and exits 1 if any failed; prints "ok N" otherwise.
#include <cstdint>
#include <cstdio>
#include <set>
#include <tuple>
#include <vector>

#include "nvfp4/launch.h"

namespace {

int failures = 0;
int checks = 0;

void Check(bool ok, const char* what, int64_t a = 0, int64_t b = 0) {
  ++checks;
  if (!ok) {
    ++failures;
    std::printf("FAIL %s (%lld, %lld)\n", what, static_cast<long long>(a),
                static_cast<long long>(b));
  }
}

using nvfp4::GridFor;
using nvfp4::kBlock;
using nvfp4::kLaunchThreads;
using nvfp4::kMaxGridX;
using nvfp4::kMaxStridedGrid;
using nvfp4::StridedGridFor;

void GridSizes() {
  // The smallest tensors: one 16-block is one thread, one thread block.
  Check(GridFor(1) == 1, "GridFor(1)", GridFor(1));
  Check(GridFor(0) == 1, "GridFor(0) is a valid grid", GridFor(0));
  Check(GridFor(kLaunchThreads) == 1, "GridFor(256)", GridFor(kLaunchThreads));
  Check(GridFor(kLaunchThreads + 1) == 2, "GridFor(257)", GridFor(kLaunchThreads + 1));
  // 2^31 elements (a 32768 x 65536 bf16 tensor): 2^27 blocks, 2^19 thread blocks; past it.
  const int64_t two31 = int64_t{1} << 31;
  Check(GridFor(two31 / kBlock) == (int64_t{1} << 19), "GridFor 2^31 elements",
        GridFor(two31 / kBlock));
  Check(GridFor(two31 / kBlock + 1) == (int64_t{1} << 19) + 1, "GridFor 2^31 + 16 elements",
        GridFor(two31 / kBlock + 1));
  // 2^31 threads and more: the grid exceeds what a 32-bit int block count could address.
  Check(GridFor(two31) == two31 / kLaunchThreads, "GridFor(2^31)", GridFor(two31));
  Check(GridFor(int64_t{1} << 38) == (int64_t{1} << 30), "GridFor(2^38)",
        GridFor(int64_t{1} << 38));
  Check(GridFor(int64_t{1} << 40) == 0, "GridFor(2^40): 2^32 blocks do not fit",
        GridFor(int64_t{1} << 40));
  // The grid limit itself: the largest launchable count, then the first that is not.
  const int64_t most = kMaxGridX * kLaunchThreads;
  Check(GridFor(most) == kMaxGridX, "GridFor at the limit", GridFor(most));
  Check(GridFor(most + 1) == 0, "GridFor past the limit is 0", GridFor(most + 1));
  Check(GridFor(INT64_MAX) == 0, "GridFor(INT64_MAX) is 0, no overflow", GridFor(INT64_MAX));
  for (int64_t t : {int64_t{1}, int64_t{255}, int64_t{256}, int64_t{257}, two31 + 3}) {
    const int64_t g = GridFor(t);
    Check(g * kLaunchThreads >= t && (g - 1) * kLaunchThreads < t, "GridFor covers exactly", t, g);
  }
  // Grid-stride kernels: capped, never 0.
  Check(StridedGridFor(0) == 1, "StridedGridFor(0)", StridedGridFor(0));
  Check(StridedGridFor(1) == 1, "StridedGridFor(1)", StridedGridFor(1));
  Check(StridedGridFor(two31) == kMaxStridedGrid, "StridedGridFor(2^31)", StridedGridFor(two31));
  Check(StridedGridFor(INT64_MAX) == kMaxStridedGrid, "StridedGridFor(INT64_MAX)",
        StridedGridFor(INT64_MAX));
}

// Every 16-block of a rows x cols tensor is quantized by exactly one lane of the 16x16
// kernel's grid; the 16 lanes of a half-warp hold the 16 rows of one tile.
void Quantize2dCovers(int64_t rows, int64_t cols) {
  const int64_t threads = nvfp4::Quantize2dThreads(rows, cols);
  const int64_t launched = GridFor(threads) * kLaunchThreads;
  const int64_t bpr = cols / kBlock;
  std::vector<int> seen(rows * bpr, 0);
  for (int64_t half = 0; half < launched / 16; ++half) {
    const auto first = nvfp4::Quantize2dPlaceOf(half * 16, rows, cols);
    std::set<int64_t> tile_rows;
    for (int64_t lane = 0; lane < 16; ++lane) {
      const auto p = nvfp4::Quantize2dPlaceOf(half * 16 + lane, rows, cols);
      Check(p.valid == first.valid, "a half-warp is all valid or all not", rows, cols);
      if (!p.valid) continue;
      Check(p.row >= 0 && p.row < rows, "row in range", p.row, rows);
      Check(p.col_block >= 0 && p.col_block < bpr, "col block in range", p.col_block, bpr);
      Check(p.block == p.row * bpr + p.col_block, "flat block index", p.block, p.row);
      Check(p.col_block == first.col_block && p.row / kBlock == first.row / kBlock,
            "a half-warp holds one tile", p.row, p.col_block);
      tile_rows.insert(p.row);
      ++seen[p.block];
    }
    Check(!first.valid || tile_rows.size() == 16, "a tile's 16 rows", rows, cols);
  }
  for (size_t b = 0; b < seen.size(); ++b) {
    Check(seen[b] == 1, "every block exactly once", static_cast<int64_t>(b), seen[b]);
  }
  Check(threads <= launched && launched - threads < kLaunchThreads, "grid covers the threads",
        threads, launched);
}

// 2^32 elements (65536 x 65536) and an odd tile count: no index wraps, the last lane of the
// last warp lands on the last block.
void Quantize2dLarge() {
  for (auto [rows, cols] : {std::tuple<int64_t, int64_t>{65536, 65536},
                            std::tuple<int64_t, int64_t>{16, (int64_t{1} << 31) + 16},
                            std::tuple<int64_t, int64_t>{(int64_t{1} << 27), 48}}) {
    const int64_t threads = nvfp4::Quantize2dThreads(rows, cols);
    Check(threads > 0 && GridFor(threads) > 0, "2d large: launchable", rows, cols);
    const int64_t bpr = cols / kBlock;
    const int64_t last_block = rows * bpr - 1;
    bool found = false;
    // The last warp: its lanes hold the last tile (pair) of the last row group.
    for (int64_t t = threads - 32; t < threads; ++t) {
      const auto p = nvfp4::Quantize2dPlaceOf(t, rows, cols);
      if (p.valid) {
        Check(p.block >= 0 && p.block <= last_block, "2d large: block in range", p.block,
              last_block);
        found = found || p.block == last_block;
      }
    }
    Check(found, "2d large: the last block is quantized", rows, cols);
    const auto first = nvfp4::Quantize2dPlaceOf(0, rows, cols);
    Check(first.valid && first.block == 0, "2d large: thread 0 has block 0", first.block, 0);
    // Lanes past the end (the grid's padding) are invalid.
    const auto past = nvfp4::Quantize2dPlaceOf(threads, rows, cols);
    Check(!past.valid, "2d large: padding lanes invalid", threads, past.block);
  }
  // 1x16 kernel: one thread per block, 2^31+ elements.
  Check(nvfp4::Quantize1dThreads(32768, 65552) == int64_t{32768} * 4097, "1d threads", 0, 0);
}

}  // namespace

int main() {
  GridSizes();
  for (auto [rows, cols] : {std::tuple<int64_t, int64_t>{16, 16}, {16, 32}, {16, 48}, {48, 32},
                            {32, 80}, {64, 16 * 33}, {16 * 17, 16 * 5}}) {
    Quantize2dCovers(rows, cols);
  }
  Quantize2dLarge();
  if (failures) {
    std::printf("%d of %d checks failed\n", failures, checks);
    return 1;
  }
  std::printf("ok %d\n", checks);
  return 0;
}
