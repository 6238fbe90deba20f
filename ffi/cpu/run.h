// Running a quantize-like kernel over a tensor on XLA's thread pool: shared by the handlers
// of nvfp4_quantize / nvfp4_fake_quantize (cpu/handlers.cc) and of nvfp4_grouped_quantize
// (cpu/grouped.cc), which runs it once per group.
#ifndef NVFP4_CPU_RUN_H_
#define NVFP4_CPU_RUN_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "cpu/kernel_table.h"
#include "cpu/parallel.h"
#include "nvfp4/numerics.h"

namespace nvfp4::cpu {

// About this many elements per parallel chunk: large enough to amortize waking a pool
// thread (tens of microseconds), which the vectorized kernels spend on ~100K elements.
constexpr int64_t kGrainElements = 1 << 17;

inline int64_t GrainItems(int64_t elements_per_item, int64_t grain = kGrainElements) {
  return std::max<int64_t>(1, grain / std::max<int64_t>(1, elements_per_item));
}

inline void AtomicMax(std::atomic<uint32_t>& a, uint32_t v) {
  uint32_t cur = a.load(std::memory_order_relaxed);
  while (v > cur && !a.compare_exchange_weak(cur, v)) {
  }
}

// Runs a quantize-like kernel over the whole tensor; returns whether all input was finite.
inline bool RunQuantize(xla::ffi::ThreadPool& pool, QuantizeRangeFn fn, const QuantizeJob& job) {
  std::atomic<uint32_t> seen{0};
  ParallelFor(pool, job.rows / job.rows_per_item(), GrainItems(job.rows_per_item() * job.cols),
              [&](int64_t begin, int64_t end) {
                std::vector<uint32_t> scratch(job.scratch_words());
                AtomicMax(seen, fn(job, begin, end, scratch.data()));
              });
  return seen.load() < kInfBits;
}

}  // namespace nvfp4::cpu

#endif  // NVFP4_CPU_RUN_H_
