// Picks the kernel table for the CPU we run on (or the variant a test asked for).
#include <atomic>
#include <cstring>

#include "cpu/kernel_table.h"

namespace nvfp4::cpu {
namespace {

// The variants this CPU runs, best last.
int RunnableTables(const KernelTable* out[3]) {
  int n = 0;
  out[n++] = &baseline::Table();
#if defined(NVFP4_HAVE_X86_VARIANTS)
  // The variants are built with -march=x86-64-v3 and -v4: ask for exactly those levels.
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v3")) out[n++] = &avx2::Table();
  if (__builtin_cpu_supports("x86-64-v4")) out[n++] = &avx512::Table();
#endif
  return n;
}

const KernelTable& DetectTable() {
  const KernelTable* tables[3];
  return *tables[RunnableTables(tables) - 1];
}

std::atomic<const KernelTable*> forced{nullptr};

}  // namespace

const KernelTable& BestTable() {
  if (const KernelTable* t = forced.load(std::memory_order_acquire)) return *t;
  static const KernelTable& detected = DetectTable();
  return detected;
}

const char* CurrentIsa() { return BestTable().isa; }

bool ForceTable(const char* isa) {
  if (isa == nullptr || isa[0] == '\0') {
    forced.store(nullptr);
    return true;
  }
  const KernelTable* tables[3];
  const int n = RunnableTables(tables);
  for (int i = 0; i < n; ++i) {
    if (std::strcmp(tables[i]->isa, isa) == 0) {
      forced.store(tables[i]);
      return true;
    }
  }
  return false;
}

}  // namespace nvfp4::cpu
