// Splitting a loop over rows across XLA's intra-op thread pool.
//
// The FFI thread pool promises nothing about when or whether scheduled tasks run in
// parallel (a pool of one thread may be the one running this handler). So the caller
// never waits for a task to start: workers and the caller claim chunks from a shared
// counter, the caller keeps claiming until none are left, and then waits only for the
// chunks already claimed, which are running. A task that starts late finds no chunk and
// returns without touching anything but the shared state it co-owns.
#ifndef NVFP4_CPU_PARALLEL_H_
#define NVFP4_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace nvfp4::cpu {

using ChunkFn = std::function<void(int64_t begin, int64_t end)>;

namespace internal {

struct ChunkQueue {
  int64_t items = 0;
  int64_t chunk = 1;
  int64_t chunks = 0;
  const ChunkFn* fn = nullptr;  // valid while done < chunks: the caller is waiting
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Claims and runs chunks until none are left.
  void Drain() {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      const int64_t begin = c * chunk;
      (*fn)(begin, std::min(items, begin + chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

}  // namespace internal

// Runs fn over [0, items) in chunks of about `grain` items, on the pool and the caller;
// on at most `max_threads` threads when it is positive.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, int64_t grain,
                        const ChunkFn& fn, int64_t max_threads = 0) {
  if (items <= 0) return;
  int64_t threads = pool.num_threads();
  if (max_threads > 0) threads = std::min(threads, max_threads);
  grain = std::max<int64_t>(grain, 1);
  if (threads <= 1 || items <= grain) {
    fn(0, items);
    return;
  }
  auto queue = std::make_shared<internal::ChunkQueue>();
  queue->items = items;
  // A few chunks per thread balance uneven progress without much claiming overhead; a
  // multiple of the thread count, so that no thread has one chunk more than another.
  int64_t target_chunks = std::min((items + grain - 1) / grain, 4 * threads);
  target_chunks = std::min(items, (target_chunks + threads - 1) / threads * threads);
  queue->chunk = (items + target_chunks - 1) / target_chunks;
  queue->chunks = (items + queue->chunk - 1) / queue->chunk;
  queue->fn = &fn;
  const int64_t helpers = std::min(threads, queue->chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([queue] { queue->Drain(); });
  }
  queue->Drain();
  while (queue->done.load(std::memory_order_acquire) < queue->chunks) {
    std::this_thread::yield();
  }
}

}  // namespace nvfp4::cpu

#endif  // NVFP4_CPU_PARALLEL_H_
