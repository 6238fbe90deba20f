// Running a quantize-like kernel over a tensor on XLA's thread pool: shared by the handlers
// of nvfp4_quantize / nvfp4_fake_quantize (cpu/handlers.cc) and of nvfp4_grouped_quantize
// (cpu/grouped.cc), which runs it once per group. Also what the CPU handler files share:
// the grain of the parallel loops, the huge-page advice for large results, the GEMMs'
// thread limit.
#ifndef NVFP4_CPU_RUN_H_
#define NVFP4_CPU_RUN_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

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

// A large result buffer is usually fresh memory from the allocator, whose pages the kernel
// faults in and zeroes one 4 KiB page at a time on the first write: for a 32 MiB result
// that is 8192 faults, which cost more than writing the values. Asking for transparent huge
// pages (where the system allows them on request) makes that 16 faults of 2 MiB.
inline void AdviseHugePages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < static_cast<int64_t>(2 * kHuge)) return;
  const uintptr_t first = reinterpret_cast<uintptr_t>(data);
  const uintptr_t begin = (first + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (first + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data, (void)bytes;
#endif
}

// The GEMMs' thread limit for tests (cpu/gemm.cc; 0: all the pool has).
int64_t GemmMaxThreads();

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
